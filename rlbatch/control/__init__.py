"""Control: the action vocabulary, controllers, the guard, observation, reward."""
