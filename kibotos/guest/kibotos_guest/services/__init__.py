"""The agent's request handlers, loaded on first use (`..core.Agent`): processes, files
and their transfers (uploads, downloads, tar streams, watches), port forwarding and the
guest network's configuration."""
