"""HTTP transport (foundation layer): the bounded retrying client transport (``retry``), the Search-R1
``/retrieve`` client engine (``client``) and the generic engine server (``server``).

May import: ``zerosim.core`` and third-party libraries.
"""
