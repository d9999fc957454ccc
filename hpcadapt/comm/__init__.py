"""Communication: the world (the only owner of membership and the cluster version), the
collectives, fusion, buffers, topologies and node-local transfer. Imports ``base`` only."""
