"""The control plane: settings, job ledger, Ray gateway, reconciler and CLI. No FastAPI here."""
