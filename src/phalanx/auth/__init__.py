"""Identity for every API call: keys, credentials, the local credential service.

See docs/security.md for the model (local credentials as with MUNGE, bearer tokens, per-node
agent credentials) and how keys are rotated.
"""
