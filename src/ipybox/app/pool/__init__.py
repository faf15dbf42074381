"""The pool subsystem of the application side."""
