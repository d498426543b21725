// Package nats holds onceflow's NATS JetStream naming rules, stream creation and the tolerant
// unmarshaler that package broker's nats:// scheme uses.
package nats
