"""The ``autoplan`` command: one module per subcommand (``*_cmd.py``), ``main.py`` the parser.

A command imports what it runs when it runs (imports inside its functions): ``autoplan --help``
and a command's start load neither torch nor the layers other commands need.
"""
