"""Who may do what on the bus: roles and their permissions, identities, TLS (docs/security.md)."""
