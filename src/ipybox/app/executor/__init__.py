"""The executor subsystem of the application side."""
