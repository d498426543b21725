package nats

import (
	"context"
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
