"""Request and result shapes of ctrl's HTTP API (pydantic), one module per area.
"""
