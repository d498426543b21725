package nats

import (
	"crypto/sha256"
	"encoding/hex"
)

// StreamName returns the name of the JetStream stream that onceflow creates for topic: topic
// itself when it has only letters, digits, '-' and '_'; otherwise topic with the other
// characters replaced by '_' and a hash of topic appended, so that different topics never share
// a name.
func StreamName(topic string) string { return name(topic) }

// ConsumerName returns the name of the durable JetStream consumer of a consumer group on a
// topic. Every subscription of the group to the topic, in any process, pulls from it.
func ConsumerName(group, topic string) string { return name(group + "_" + topic) }

// name turns s into a valid JetStream stream or consumer name, as StreamName says.
func name(s string) string {
	clean := true
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '_'
			clean = false
		}
	}
	if clean {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return string(b) + "_" + hex.EncodeToString(sum[:4])
}
