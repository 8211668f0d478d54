"""HTTP: the FastAPI app, its routers, schemas, auth and error mapping."""
