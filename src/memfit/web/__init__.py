"""``memfit serve``: the estimate and the plan as a local web page (issue 38), over the same library API.

``form`` reads the page's controls from the settings schema; ``service`` answers the page's requests with
the calls ``memfit estimate`` and ``memfit plan`` make; ``jobs`` runs the exact trace off the request path;
``app`` is the ASGI app (Starlette, the ``web`` extra) and ``serve``; ``static/`` is the page itself.
"""
