"""The API families, one module or package each: parse a request, call the service, choose the response."""
