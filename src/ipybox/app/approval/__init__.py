"""The approval subsystem of the application side."""
