"""The machinery every command shares: kibo's configuration, its client for ctrl's API,
options and exit codes, output, paging and waiting.  The standard library and click
only, as far as possible, so that ``kibo`` starts fast (tests/cli/test_cli_imports.py).
"""
