"""The ``pdserve`` command: the composition root (layer 7). It may import any package; none imports it.

``main.py`` dispatches what ``parser.py`` parses to the ``*_cmds.py`` modules.
"""
