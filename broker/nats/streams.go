package nats

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go/jetstream"
)

// Streams finds or creates the JetStream stream that stores a topic, and remembers the answer.
// It is safe for concurrent use.
type Streams struct {
	js jetstream.JetStream

	mu    sync.Mutex
	known map[string]string // topic -> stream
}

// NewStreams returns a Streams that works through js.
func NewStreams(js jetstream.JetStream) *Streams {
	return &Streams{js: js, known: map[string]string{}}
}

// Ensure returns the name of the stream that captures topic's subject. When none does, it
// creates one named StreamName(topic), capturing only that subject, with file storage and
// limits retention: messages stay until the stream's limits remove them, so that every
// consumer group can read them. A stream that another process creates at the same time is
// found and used.
func (s *Streams) Ensure(ctx context.Context, topic string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if name, ok := s.known[topic]; ok {
		return name, nil
	}
	name, err := s.js.StreamNameBySubject(ctx, topic)
	if err != nil {
		name = StreamName(topic)
		_, err = s.js.CreateStream(ctx, jetstream.StreamConfig{
			Name:      name,
			Subjects:  []string{topic},
			Storage:   jetstream.FileStorage,
			Retention: jetstream.LimitsPolicy,
		})
		if err != nil {
			// Another process may have created it in the meantime.
			if found, err2 := s.js.StreamNameBySubject(ctx, topic); err2 == nil {
				name, err = found, nil
			}
		}
		if err != nil {
			return "", fmt.Errorf("create JetStream stream %q for subject %q: %w", name, topic, err)
		}
	}
	s.known[topic] = name
	return name, nil
}

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
