"""Process supervision for `moemesh up`: start the mesh's services as child processes, wait until
each is healthy, watch them, and stop every one of them (no orphans) on a signal or a crash."""
