"""Test-side parts of the runtime: the hooks tests give worker ranks, and the entries that start ranks with them."""
