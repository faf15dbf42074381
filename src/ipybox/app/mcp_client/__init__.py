"""The mcp_client subsystem of the application side."""
