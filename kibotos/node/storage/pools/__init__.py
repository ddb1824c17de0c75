"""Storage pools on the node: marker, directories, availability, leftovers, old names.

spec/storage-pools-on-nfs.txt is the contract.  The pieces, one module each:

* `marker`: the ``.kibotos-storage-pool`` file that proves which pool a directory is,
  and ``kibotos-node storage-pool init``, the only thing that writes it;
* `dirs`: the fixed subdirectories, their owner and mode, and block-file ownership;
* `availability`: the marker check, then the pool's driver plugin, refreshed at least
  once a minute, as facts for ctrl;
* `tempfiles`: removal of temporary files left by interrupted writes;
* `legacy_names`: objects still named by the SHA-256 of their ID (before v0.1.0),
  renamed to their IDs.
"""
