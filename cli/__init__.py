"""The ``pdserve`` command: the composition root (layer 7). It may import any package; none imports it.

``main.py`` dispatches what ``parser.py`` parses to the commands: ``cluster_cmds.py`` (``up``, ``down``),
``scale_cmds.py``, ``autoscale_cmds.py`` and ``monitoring.py`` over the local launcher (``deploy.local``);
``serve_cmds.py`` (``router``, ``worker`` in the foreground); ``client_cmds.py`` (``status``, ``generate``,
``drain``, ``bench``) over ``client.py``.
"""
