"""The control plane: the contract between the coordinator and the worker ranks, over one Redis per run.

Importing this package imports nothing heavy (no redis); import the modules you need:

- ``server``   :class:`RedisServer` (the run's private redis-server, or ``redis.url``) and :func:`connect`
- ``wire``     JSON message models (:class:`Command`, :class:`Ack`, :class:`Registration`) and :class:`WireError`
- ``registry`` :class:`Registry` (register, heartbeat, liveness) and the rank-side :class:`Heartbeater`
- ``commands`` coordinator :class:`CommandBus` (send, await_acks) and rank-side :class:`CommandReceiver`
- ``health``   the coordinator's Redis round trips (:class:`RoundTrips`) and the pure liveness decision that does not
  count a window in which Redis was slow (:func:`lost_ranks`)
- ``secret``   an external Redis's password: owner-only files, and :func:`redact` for every URL written or logged
- ``keys``     the key layout; ``demo`` the ``dynaresize demo`` command

Protocol in short (all keys under ``dr:<job_id>:``, so jobs sharing a Redis never see each other):

1. **Endpoint.** The coordinator's :class:`RedisServer` writes ``<run_dir>/redis/redis.json`` {host, port,
   password_file}; every rank calls ``connect(that file, role=...)``. The password lives in a 0600 file.
2. **Registry.** A rank registers (``rank:<r>`` hash with a TTL, ``live`` zset scored by server TIME) and gets an
   **incarnation** (``inc:<r>``, bumped on every register; an older process of the same rank is superseded). A
   registration is bound to the launch of the ranks (``launch``): one of an earlier launch, or for a rank a live
   process of the current launch holds, is refused and that process exits. It
   heartbeats every ``heartbeat_s``; the coordinator's ``liveness()`` reports ranks whose last beat is older than
   ``heartbeat_s * dead_after_heartbeats`` as dead (no keyspace notifications needed).
3. **Epochs.** Each coordinator incarnation INCRs ``epoch``. Sends from an older epoch fail (``FencedError``), and
   ranks reject commands whose epoch is below the job's epoch or the highest they saw (error ack + ``control``
   event).
4. **Commands.** One stream per rank (``cmd:<r>``) and one job-wide broadcast stream (``bcast``): a send for
   several ranks is one entry of ``bcast``, for one rank an entry of its stream, in one Lua call that also
   PUBLISHes a wake-up on ``wake``. Pub/sub only wakes; a rank always reads both streams from its own persisted
   cursors (``cursor:<r>``, ``bcursor:<r>``) and merges them by their job-wide increasing ids, so commands sent
   while it was disconnected arrive later, in order.
5. **At most once.** A rank claims a command id in ``applied:<r>`` before applying it; a retried (re-sent)
   command gets the stored ack back (``replayed``) and is not applied again.
6. **Acks.** Written to ``ack:<command_id>`` (a stream, expiring); ``await_acks`` returns (acks by rank, missing).
7. **Bad input.** Malformed, unknown, oversized messages raise :class:`WireError` inside the receiver, which
   logs it, emits a ``control`` event, acks an error when the id is readable, and moves on. Nothing is pickled.
8. **Timeouts.** Every client has explicit socket/connect timeouts and a health check; blocking reads block at
   most ``block_ms`` (< socket timeout); connection errors are retried with backoff, which is safe because every
   write is idempotent or de-duplicated by the reader.
"""
