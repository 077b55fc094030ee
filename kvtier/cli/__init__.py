"""The ``kvtier`` command: look after a cache on disk without a running server.

Subcommands (one module each): ``ls``, ``stats``, ``inspect``, ``verify``, ``evict``,
``compact``. ``main.py`` builds the parser and turns every expected failure into a one-line
``kvtier: error: ...`` message with a non-zero exit status. ``_store.py`` holds the store
access the subcommands share (opening read-only under the store lock, reading record
headers cheaply, resolving namespace prefixes). It uses the public backend interface, plus
two best-effort peeks at backend internals that the interface lacks: the files backend's
record path (to read a header without the payload) and LMDB's page counts (for ``stats``).
"""
