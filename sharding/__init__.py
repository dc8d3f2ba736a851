"""Device meshes, logical-axis rules and device-to-device resharding.

Knows nothing of models or RL.
"""
