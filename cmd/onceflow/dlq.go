package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

// envBroker names the environment variable that supplies --broker when the flag is absent.
const envBroker = "ONCEFLOW_BROKER"

// Defaults of the dlq commands.
const (
	defaultListLimit   = 100
	defaultReplayLimit = 10000
	// tableReasonWidth bounds the reason column of the table; --json prints it whole.
	tableReasonWidth = 100
	// tablePayloadWidth bounds the payload column of the table.
	tablePayloadWidth = 200
)

// deadLetterHeaders are the headers the router adds to a dead letter; replay removes them.
var deadLetterHeaders = messagedata.DeadLetterHeaders

func newDLQCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List and replay dead letters",
		Long: `A message that fails permanently (a malformed payload, processor.Permanent, no usable id) is
published to the dead-letter topic with headers saying why, where and when, and acknowledged.
"dlq list" shows the dead letters waiting in that topic without taking them; "dlq replay" puts
chosen ones back on the topic they came from, with their original message id, so that the
handler's duplicate detection recognises a message that was in fact applied: replaying twice
applies nothing twice.

The dead letters are those waiting for one consumer group: the group of the --broker URL (its
group= parameter), or --group, default "onceflow". On RabbitMQ, where every group has its own
queue, use the group of the router that dead-lettered them (it publishes into <topic>.<group>).`,
	}
	cmd.AddCommand(newDLQListCommand(), newDLQReplayCommand())
	return cmd
}

// dlqFlags are the flags both dlq commands take.
type dlqFlags struct {
	broker string
	topic  string
	group  string
	limit  int
	asJSON bool
}

func (f *dlqFlags) register(cmd *cobra.Command, limit int, limitUsage string) {
	fl := cmd.Flags()
	fl.StringVar(&f.broker, "broker", "", "broker URL (default $"+envBroker+")")
	fl.StringVar(&f.topic, "topic", onceflow.DefaultDeadLetterTopic, "dead-letter topic")
	fl.StringVar(&f.group, "group", "", `consumer group whose dead letters to read (default: the URL's group= parameter, else "`+broker.DefaultConsumerGroup+`")`)
	fl.IntVar(&f.limit, "limit", limit, limitUsage)
	fl.BoolVar(&f.asJSON, "json", false, "print one JSON document on stdout")
}

// open opens the broker the flags name, in the consumer group they name.
func (f *dlqFlags) open(ctx context.Context) (*broker.Broker, error) {
	if f.limit <= 0 {
		return nil, fmt.Errorf("--limit %d: want a positive number", f.limit)
	}
	rawURL := f.broker
	if rawURL == "" {
		rawURL = os.Getenv(envBroker)
	}
	if rawURL == "" {
		return nil, errors.New("no broker: pass --broker URL or set " + envBroker + " (amqp://, postgres://, mysql://, sqlite://, nats:// or redis://)")
	}
	if f.group != "" {
		// The last group= parameter wins: the flag overrides the URL's.
		sep := "?"
		if strings.Contains(rawURL, "?") {
			sep = "&"
		}
		rawURL += sep + "group=" + url.QueryEscape(f.group)
	}
	return broker.Open(ctx, rawURL, broker.Options{})
}

// deadLetter is one dead letter as the commands print it.
type deadLetter struct {
	ID            string            `json:"id"`
	Time          string            `json:"time"`
	Topic         string            `json:"topic"`
	Handler       string            `json:"handler"`
	Attempt       int               `json:"attempt"`
	Reason        string            `json:"reason"`
	Replays       int               `json:"replays"`
	PayloadSize   int               `json:"payload_size"`
	Payload       *string           `json:"payload,omitempty"`
	PayloadBase64 string            `json:"payload_base64,omitempty"`
	Headers       map[string]string `json:"headers"`
}

// describe turns a dead-letter message into a deadLetter; the payload only if withPayload.
func describe(m *message.Message, withPayload bool) deadLetter {
	md := m.Metadata
	d := deadLetter{
		ID:          m.UUID,
		Time:        md.Get(messagedata.HeaderDeadLetterTime),
		Topic:       md.Get(messagedata.HeaderDeadLetterTopic),
		Handler:     md.Get(messagedata.HeaderDeadLetterHandler),
		Reason:      md.Get(messagedata.HeaderDeadLetterReason),
		PayloadSize: len(m.Payload),
		Headers:     map[string]string{},
	}
	d.Attempt, _ = strconv.Atoi(md.Get(messagedata.HeaderDeadLetterAttempt))
	d.Replays, _ = strconv.Atoi(md.Get(messagedata.HeaderReplayCount))
	for k, v := range md {
		switch {
		case strings.HasPrefix(k, "onceflow_dlq_"):
			// Shown as the fields above.
		case k == broker.HeaderAMQPRedelivered || k == messagedata.HeaderAMQPMessageID:
			// Properties of the AMQP delivery the dead letter was read with, not headers of
			// the message (reading it without consuming sets the redelivered flag).
		default:
			d.Headers[k] = v
		}
	}
	if withPayload {
		if utf8.Valid(m.Payload) {
			p := string(m.Payload)
			d.Payload = &p
		} else {
			d.PayloadBase64 = base64.StdEncoding.EncodeToString(m.Payload)
		}
	}
	return d
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// where says which dead letters a command looked at, for the last line of its text output.
func where(topic, group, brokerURL string) string {
	return fmt.Sprintf("in %s for consumer group %s on %s", printable(topic), printable(group), printable(brokerURL))
}
