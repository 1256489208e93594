"""What a platform-managed role adds to a run: the role entry points, the command desk and the HTTP reporter."""
