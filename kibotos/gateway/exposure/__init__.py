"""The Exposure gateway: an HTTP reverse proxy from ``<port>-<sandbox>.<domain>`` (or
the ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers) to that port in the sandbox,
through the data plane's port streams (docs/gateways.md)."""
