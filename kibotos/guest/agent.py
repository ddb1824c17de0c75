#!/usr/bin/env python3
"""kibotos-guest launcher: ``python3 agent.py [options]`` runs the agent in the
`kibotos_guest` package beside this file (docs/guest-protocol.md).

The body lives in the package, not here, because Python never caches a main script
as bytecode: the guest would recompile all of it at every boot.  Imported modules are
loaded from the ``__pycache__`` a Template build writes, so this file stays tiny.  Its
directory goes first on ``sys.path`` so that ``python3 -I agent.py`` (no script
directory on the path) works too.

Imported as ``kibotos.guest.agent`` (the host side), it re-exports the protocol
constants and framing that older imports expect.
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
    import kibotos_guest  # type: ignore[import-not-found]  # found through the line above

    sys.exit(kibotos_guest.main())
else:
    from kibotos.guest.kibotos_guest import (
        AGENT_VERSION,
        CAPABILITIES,
        DEFAULT_PORT_NAME,
        PROTOCOL_VERSION,
        main,
    )
    from kibotos.guest.kibotos_guest.runtime.framing import (
        DATA_CHUNK,
        DEFAULT_WINDOW,
        FLAG_EOF,
        HEADER_SIZE,
        KIND_CONTROL,
        KIND_DATA,
        MAGIC,
        MAX_PAYLOAD,
        MAX_WINDOW,
        RESYNC_PREAMBLE_SIZE,
        Frame,
        FrameDecoder,
        FrameError,
        encode_control,
        encode_data,
        encode_frame,
    )
    from kibotos.guest.kibotos_guest.runtime.sysio import FIFREEZE, FITHAW
    from kibotos.guest.kibotos_guest.runtime.transport import find_port_device

    __all__ = [
        "AGENT_VERSION", "CAPABILITIES", "DATA_CHUNK", "DEFAULT_PORT_NAME", "DEFAULT_WINDOW",
        "FIFREEZE", "FITHAW", "FLAG_EOF", "HEADER_SIZE", "KIND_CONTROL", "KIND_DATA",
        "MAGIC", "MAX_PAYLOAD", "MAX_WINDOW", "PROTOCOL_VERSION", "RESYNC_PREAMBLE_SIZE",
        "Frame", "FrameDecoder", "FrameError", "encode_control", "encode_data",
        "encode_frame", "find_port_device", "main",
    ]
