"""ctrl's HTTP API: the route table, authentication, one module of handlers per area,
the OpenAPI document and the request metrics.

Handlers parse with `kibotos.ctrl.wire`, act through the services in `kibotos.ctrl.live`,
and never hold state of their own.
"""
