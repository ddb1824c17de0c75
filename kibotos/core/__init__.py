"""The leaf modules every part of kibotos uses and none owns: errors and their wire
codes, IDs, units, atomic writes, TOML files, control characters, CIDRs, key and
credential files, failpoints, logging, /proc reading and descriptor passing.  They
import nothing of kibotos outside this folder, so ctrl, the node, the data plane, the
gateways and the CLI can all depend on them without depending on each other."""
