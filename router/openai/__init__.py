"""The OpenAI-compatible HTTP front of the router: ``protocol`` (request/response shapes), ``mapping``
(to and from ``pdserve.v1`` messages), ``tokenize`` and ``server`` (aiohttp handlers).
"""
