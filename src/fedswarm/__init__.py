"""fedswarm: a decentralized peer-to-peer compute federation."""
