"""HTTP routes, one module per resource; each route validates, calls storage, shapes the reply."""
