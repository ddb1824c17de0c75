"""Code kibotos does not write: E2B's envd protocol definitions and protoc's output.

`envd/` holds envd's `.proto` files as E2B publishes them (the wire the SDK speaks) and
the modules `make envd-protos` generates from them. They are kept apart from the
gateway's own modules so that edits, reviews and duplicate checks address only code
written here; change them only by updating the `.proto` files and regenerating.
"""
