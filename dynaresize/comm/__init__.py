"""Communicators: pre-built process groups (``groups``) and the chunked weight broadcast over them (``weights``)."""
