package middleware

// WithGroupJoined calls fn after each member joined an open group, with the group's size then,
// so that tests can act once a member is known to wait in a group.
func WithGroupJoined(fn func(size int)) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.hooks.joined = fn })
}
