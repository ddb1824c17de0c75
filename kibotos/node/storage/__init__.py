"""Storage pools and their objects on the node: block files, holder records and receipts,
expansion, copy, Transfer archives, the Template cache and the holder check (fencing).
"""
