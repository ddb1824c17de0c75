"""The E2B gateway: E2B's control API and envd's API, served over Workspaces, so the
official ``e2b`` SDK runs unchanged against a kibotos cluster (docs/gateways.md)."""
