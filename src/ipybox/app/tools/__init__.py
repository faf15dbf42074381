"""The tools subsystem of the application side."""
