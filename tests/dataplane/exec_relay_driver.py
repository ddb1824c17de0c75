"""``kibo workspace exec``'s relay (`kibotos.cli.workspace.exec_relay.relay`) as a process of its
own, wired to this process's stdin, stdout and stderr, for tests/dataplane/
test_exec_blocking.py: what ctrl would hand over (the data plane's URL and a session
credential) comes on the command line instead.

    python exec_relay_driver.py URL CREDENTIAL JSON_OPTIONS -- ARGV...

JSON_OPTIONS: ``{"env": {}, "cwd": null, "tty": false, "timeout": null}``.  Exits with
the command's status, or prints ``error: <code>: <message>`` and exits with the error
class's code, as kibo does.
"""

from __future__ import annotations

import json
import sys

from kibotos.cli.workspace.exec_relay import GlobalDeadline, relay
from kibotos.core.errors import KibotosError


def main() -> int:
    url, credential, options, sep, *argv = sys.argv[1:]
    assert sep == "--", sys.argv
    opts = json.loads(options)
    try:
        return relay(url, credential, tuple(argv), env=opts.get("env", {}),
                     cwd=opts.get("cwd"), tty=opts.get("tty", False),
                     timeout=opts.get("timeout"), user=opts.get("user"))
    except GlobalDeadline:
        print("error: deadline_exceeded: the global --timeout passed", file=sys.stderr)
        return 16
    except KibotosError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
