package broker

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/redact"
)

// publisher is the Broker's shared message.Publisher.
type publisher struct {
	b *Broker
}

var _ message.Publisher = (*publisher)(nil)

// Publish checks the topic, prepares it if the scheme needs that, and publishes messages with
// the upstream publisher.
func (p *publisher) Publish(topic string, messages ...*message.Message) error {
	b := p.b
	if !b.life.Enter() {
		return ErrClosed
	}
	defer b.life.Leave()

	if err := b.checkTopic(topic); err != nil {
		return err
	}
	for i, m := range messages {
		if m == nil {
			return fmt.Errorf("broker: publish to %q: message %d of %d is nil", topic, i+1, len(messages))
		}
		if b.be.CheckMessage != nil {
			if err := b.be.CheckMessage(m); err != nil {
				return fmt.Errorf("broker: publish to %q: message %d of %d: %w", topic, i+1, len(messages), err)
			}
		}
	}
	if b.be.PreparePublish != nil {
		if err := b.be.PreparePublish(topic); err != nil {
			return redact.Error(fmt.Errorf("broker: prepare topic %q on %s: %w", topic, b.redacted, err), b.secrets)
		}
	}
	if err := b.be.Publisher.Publish(topic, messages...); err != nil {
		return redact.Error(fmt.Errorf("broker: publish to %q on %s: %w", topic, b.redacted, err), b.secrets)
	}
	return nil
}

// Close does nothing: the publisher is shared, and Broker.Close closes it.
func (p *publisher) Close() error { return nil }
