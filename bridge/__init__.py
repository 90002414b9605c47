"""slime's side of Turnstile: rollout functions with slime's signatures and Trajectory -> Sample conversion."""
