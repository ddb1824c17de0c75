"""Gateways: services that let clients written for another system use a kibotos
cluster, as clients of ctrl's HTTP API and of the nodes' data planes (docs/gateways.md).
"""
