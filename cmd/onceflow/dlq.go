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
	"sort"
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
		Short: "List, replay and delete dead letters",
		Long: `A message that fails permanently (a malformed payload, processor.Permanent, no usable id) is
published to the dead-letter topic with headers saying why, where and when, and acknowledged.
"dlq list" shows the dead letters waiting in that topic without taking them, grouped by handler
and reason; "dlq replay" puts chosen ones back on the topic they came from, with their original
message id, so that the handler's duplicate detection recognises a message that was in fact
applied: replaying twice applies nothing twice; "dlq delete" removes chosen ones for good, after
asking. Replay and delete choose by --id, --reason or --all.

The dead letters are those waiting for one consumer group: the group of the --broker URL (its
group= parameter), or --group, default "onceflow". On RabbitMQ, where every group has its own
queue, use the group of the router that dead-lettered them (it publishes into <topic>.<group>).`,
	}
	cmd.AddCommand(newDLQListCommand(), newDLQReplayCommand(), newDLQDeleteCommand())
	return cmd
}

// dlqFlags are the flags every dlq command takes.
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

// open opens the broker the flags name, in the consumer group they name. A queue file that
// does not exist is reported, not created.
func (f *dlqFlags) open(ctx context.Context) (*broker.Broker, error) {
	if f.limit <= 0 {
		return nil, usagef("--limit %d: want a positive number", f.limit)
	}
	rawURL := f.broker
	if rawURL == "" {
		rawURL = os.Getenv(envBroker)
	}
	if rawURL == "" {
		return nil, usageError(errors.New("no broker: pass --broker URL or set " + envBroker + " (amqp://, postgres://, mysql://, sqlite://, nats://, redis:// or kafka://)"))
	}
	if f.group != "" {
		// The last group= parameter wins: the flag overrides the URL's.
		sep := "?"
		if strings.Contains(rawURL, "?") {
			sep = "&"
		}
		rawURL += sep + "group=" + url.QueryEscape(f.group)
	}
	return broker.Open(ctx, rawURL, broker.Options{MustExist: true})
}

// deadLetter is one dead letter as the commands print it.
type deadLetter struct {
	ID          string `json:"id"`
	Time        string `json:"time"`
	Topic       string `json:"topic"`
	Handler     string `json:"handler"`
	Attempt     int    `json:"attempt"`
	Reason      string `json:"reason"`
	Replays     int    `json:"replays"`
	PayloadSize int    `json:"payload_size"`
	// PayloadDropped says why the dead letter carries no payload: the dead-letter broker
	// refused the message with it (messagedata.HeaderDeadLetterPayloadDropped).
	PayloadDropped string `json:"payload_dropped,omitempty"`
	// OriginalID is the id of the dead-lettered message when the dead letter could not carry
	// it (messagedata.HeaderDeadLetterOriginalID).
	OriginalID    string            `json:"original_id,omitempty"`
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

		PayloadDropped: md.Get(messagedata.HeaderDeadLetterPayloadDropped),
		OriginalID:     md.Get(messagedata.HeaderDeadLetterOriginalID),
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

// selection is how replay and delete choose dead letters: by id (--id, repeatable), by reason
// (--reason, a part of the reason text) or all of them (--all), exactly one of the three.
type selection struct {
	ids    []string
	reason string
	all    bool

	wanted  map[string]bool
	found   map[string]bool // the ids that matched a dead letter
	matched int             // dead letters matched by --reason
}

// register adds the flags of the selection to cmd; verb says what the command does.
func (s *selection) register(cmd *cobra.Command, verb string) {
	fl := cmd.Flags()
	fl.StringArrayVar(&s.ids, "id", nil, "id of a dead letter to "+verb+" (repeatable); the original id of a dead letter that could not carry it matches too")
	fl.StringVar(&s.reason, "reason", "", verb+" the dead letters whose reason contains this text (case-sensitive substring; the whole reason is an exact match)")
	fl.BoolVar(&s.all, "all", false, verb+" every dead letter waiting (up to --limit)")
}

// check reports a selection that is not exactly one of --id, --reason and --all.
func (s *selection) check(cmd *cobra.Command, verb string) error {
	n := 0
	if len(s.ids) > 0 {
		n++
	}
	if cmd.Flags().Changed("reason") {
		if s.reason == "" {
			return usageError(errors.New("--reason is empty: give a part of the reasons of the dead letters to " + verb))
		}
		n++
	}
	if s.all {
		n++
	}
	if n != 1 {
		return usageError(errors.New("choose the dead letters to " + verb + ": --id ID (repeatable), --reason TEXT or --all"))
	}
	s.wanted, s.found = map[string]bool{}, map[string]bool{}
	for _, id := range s.ids {
		s.wanted[id] = true
	}
	return nil
}

// matches reports whether the selection chooses dead letter m, and remembers what matched.
func (s *selection) matches(m *message.Message) bool {
	switch {
	case s.all:
		return true
	case len(s.ids) > 0:
		hit := false
		for _, id := range []string{m.UUID, m.Metadata.Get(messagedata.HeaderDeadLetterOriginalID)} {
			if id != "" && s.wanted[id] {
				s.found[id], hit = true, true
			}
		}
		return hit
	default:
		if strings.Contains(m.Metadata.Get(messagedata.HeaderDeadLetterReason), s.reason) {
			s.matched++
			return true
		}
		return false
	}
}

// notFound returns the --id values that matched no dead letter, sorted.
func (s *selection) notFound() []string {
	out := []string{}
	for id := range s.wanted {
		if !s.found[id] {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// missed returns the error of a selection that did not find what it named: ids that matched
// no dead letter, or a reason that matched none. Nil for --all.
func (s *selection) missed(topic, group string) error {
	if ids := s.notFound(); len(ids) > 0 {
		return fmt.Errorf("no dead letter with id %s in %s for consumer group %s", strings.Join(quoteAll(ids), ", "), topic, group)
	}
	if s.reason != "" && s.matched == 0 {
		return fmt.Errorf("no dead letter whose reason contains %s in %s for consumer group %s", quoted(s.reason), topic, group)
	}
	return nil
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
