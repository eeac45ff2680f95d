"""The ``pdserve`` command: the composition root (layer 7). It may import any package; none imports it.

``main.py`` parses arguments and dispatches; ``cluster_cmds.py`` is ``up``/``scale``/``down`` over the local
launcher (``deploy.local``); ``client.py`` is ``status`` and ``generate``.
"""
