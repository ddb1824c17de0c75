"""One Instance network step in a process of its own, so a test can kill it at a
failpoint (``KIBOTOS_FAILPOINTS``) exactly as a node would die there:

    python network_proc.py setup|teardown RECORDS_DIR INSTANCE_ID HOST_NETNS
"""

from __future__ import annotations

import sys
from pathlib import Path

from netbed import SCOPE, network_config

from kibotos.node.network import enforce, plumbing
from kibotos.node.network.names import NetworkNames
from kibotos.node.network.policy import NetworkPolicy
from kibotos.node.network.records import NetworkRecords


def main(step: str, records_dir: str, instance_id: str, host_netns: str) -> None:
    records, host, config = NetworkRecords(Path(records_dir)), Path(host_netns), network_config()
    if step == "setup":
        uplink = enforce.uplink_addresses(config, host)
        record = records.allocate(instance_id, SCOPE, config, NetworkPolicy(), uplink)
        plumbing.setup(record, host_netns=host)
        enforce.write_table(records, record, config, uplink)
    elif step == "teardown":
        plumbing.teardown(NetworkNames.of(SCOPE, instance_id), host_netns=host)
        records.remove(instance_id)
    else:
        raise SystemExit(f"unknown step {step!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
