package groupcommit

// SetJoined makes the group transaction of cfg call fn after each member joined an open group,
// with the group's size then, so that tests can act once a member is known to wait in a group.
func SetJoined(cfg *Config, fn func(size int)) { cfg.joined = fn }
