"""The engine: queue -> negotiate -> fuse -> execute -> complete handles. Framework-free."""
