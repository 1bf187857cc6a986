"""Launching distributed jobs; launch.dist_setup is the small module every lesson shares."""
