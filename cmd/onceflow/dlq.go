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
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/deadletter"
)

// envBroker names the environment variable that supplies --broker when the flag is absent.
const envBroker = "ONCEFLOW_BROKER"

// Defaults of the dlq commands.
const (
	defaultListLimit   = 100
	defaultReplayLimit = deadletter.DefaultScanLimit
	// tableReasonWidth bounds the reason column of the table; --json prints it whole.
	tableReasonWidth = 100
	// tablePayloadWidth bounds the payload column of the table.
	tablePayloadWidth = 200
)

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
asking. Replay and delete choose by --id, by a filter (--reason, --handler, --from-topic,
--since, --until) or --all, and go on past a dead letter that fails, reporting each.

The dead letters are those waiting for one consumer group: the group of the --broker URL (its
group= parameter), or --group, default "onceflow". On RabbitMQ, where every group has its own
queue, use the group of the router that dead-lettered them (it publishes into <topic>.<group>).
"onceflow console" shows the same in a browser.`,
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

// open opens the broker the flags name, in the consumer group they name, and the dead-letter
// queue of --topic there, which looks at scanLimit dead letters at most. A queue file, a topic
// or a consumer group that does not exist is reported, not created or read as empty.
func (f *dlqFlags) open(ctx context.Context, scanLimit int) (*deadletter.Queue, func() error, error) {
	if f.limit <= 0 {
		return nil, nil, usagef("--limit %d: want a positive number", f.limit)
	}
	rawURL, err := brokerURL(f.broker, f.group)
	if err != nil {
		return nil, nil, err
	}
	b, err := broker.Open(ctx, rawURL, broker.Options{MustExist: true, ReportNotFound: true})
	if err != nil {
		return nil, nil, err
	}
	q, err := deadletter.New(b, deadletter.Config{Topic: f.topic, ScanLimit: scanLimit})
	if err != nil {
		_ = b.Close()
		return nil, nil, usageError(err)
	}
	return q, b.Close, nil
}

// brokerURL returns the --broker flag, else $ONCEFLOW_BROKER, with group as its group=
// parameter when not empty.
func brokerURL(flag, group string) (string, error) {
	rawURL := flag
	if rawURL == "" {
		rawURL = os.Getenv(envBroker)
	}
	if rawURL == "" {
		return "", usageError(errors.New("no broker: pass --broker URL or set " + envBroker + " (amqp://, postgres://, mysql://, sqlite://, nats://, redis:// or kafka://)"))
	}
	if group != "" {
		// The last group= parameter wins: the flag overrides the URL's.
		sep := "?"
		if strings.Contains(rawURL, "?") {
			sep = "&"
		}
		rawURL += sep + "group=" + url.QueryEscape(group)
	}
	return rawURL, nil
}

// notFound explains an error of a dead-letter topic or consumer group that does not exist.
func notFound(err error, q *deadletter.Queue) error {
	if errors.Is(err, broker.ErrNotFound) {
		return fmt.Errorf("%w: no dead-letter topic %s for consumer group %s on %s (check --topic, and --group or the URL's group=: the group of the router that dead-lettered the messages)",
			err, quoted(q.Topic()), quoted(q.Group()), printable(q.Broker()))
	}
	return err
}

// deadLetter is one dead letter as the commands print it.
type deadLetter struct {
	ID          string `json:"id"`
	Time        string `json:"time"`
	Topic       string `json:"topic"`
	Handler     string `json:"handler"`
	Deliveries  int    `json:"deliveries"` // the message's delivery count when it was given up; 0 when unknown
	Attempt     int    `json:"attempt"`    // the processing attempt of that delivery
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

// describe turns a dead letter into a deadLetter; the payload only if withPayload.
func describe(l deadletter.Letter, withPayload bool) deadLetter {
	d := deadLetter{
		ID:             l.ID,
		Topic:          l.Topic,
		Handler:        l.Handler,
		Deliveries:     l.Deliveries,
		Attempt:        l.Attempt,
		Reason:         l.Reason,
		Replays:        l.Replays,
		PayloadSize:    l.PayloadSize,
		PayloadDropped: l.PayloadDropped,
		OriginalID:     l.OriginalID,
		Headers:        l.Headers,
	}
	if !l.Time.IsZero() {
		d.Time = l.Time.UTC().Format(time.RFC3339Nano)
	}
	if withPayload {
		if utf8.Valid(l.Payload) {
			p := string(l.Payload)
			d.Payload = &p
		} else {
			d.PayloadBase64 = base64.StdEncoding.EncodeToString(l.Payload)
		}
	}
	return d
}

// filterFlags are the flags that narrow the dead letters a command looks at.
type filterFlags struct {
	handler, fromTopic, reason string
	since, until               string
}

// register adds the filter flags to cmd; verb says what the command does to the dead letters.
func (f *filterFlags) register(cmd *cobra.Command, verb string) {
	fl := cmd.Flags()
	fl.StringVar(&f.reason, "reason", "", verb+" the dead letters whose reason contains this text (case-sensitive substring; the whole reason is an exact match)")
	fl.StringVar(&f.handler, "handler", "", verb+" the dead letters of this handler")
	fl.StringVar(&f.fromTopic, "from-topic", "", verb+" the dead letters that came from this topic")
	fl.StringVar(&f.since, "since", "", verb+" the dead letters dead-lettered at or after this time: RFC 3339, or a duration ago (90m)")
	fl.StringVar(&f.until, "until", "", verb+" the dead letters dead-lettered before this time: RFC 3339, or a duration ago")
}

// set reports whether a filter flag was given.
func (f *filterFlags) set(cmd *cobra.Command) bool {
	for _, name := range []string{"reason", "handler", "from-topic", "since", "until"} {
		if cmd.Flags().Changed(name) {
			return true
		}
	}
	return false
}

// filter returns the filter the flags describe, at now.
func (f *filterFlags) filter(cmd *cobra.Command, now time.Time) (deadletter.Filter, error) {
	for _, fl := range []struct{ name, value string }{{"reason", f.reason}, {"handler", f.handler}, {"from-topic", f.fromTopic}} {
		if cmd.Flags().Changed(fl.name) && fl.value == "" {
			return deadletter.Filter{}, usagef("--%s is empty", fl.name)
		}
	}
	out := deadletter.Filter{Handler: f.handler, Topic: f.fromTopic, Reason: f.reason}
	var err error
	if out.Since, err = parseWhen("since", f.since, now); err != nil {
		return out, err
	}
	if out.Until, err = parseWhen("until", f.until, now); err != nil {
		return out, err
	}
	return out, nil
}

// parseWhen reads the time of flag name: RFC 3339, or a Go duration before now; zero if empty.
func parseWhen(name, s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, usagef("--%s %s: want an RFC 3339 time (2026-12-06T09:30:00Z) or a duration ago (90m)", name, quoted(s))
}

// selection is how replay and delete choose dead letters: by id (--id, repeatable), by a
// filter, or all of them (--all), exactly one of the three.
type selection struct {
	ids []string
	all bool
	filterFlags
}

// register adds the flags of the selection to cmd; verb says what the command does.
func (s *selection) register(cmd *cobra.Command, verb string) {
	fl := cmd.Flags()
	fl.StringArrayVar(&s.ids, "id", nil, "id of a dead letter to "+verb+" (repeatable); the original id of a dead letter that could not carry it matches too")
	fl.BoolVar(&s.all, "all", false, verb+" every dead letter waiting (up to --limit)")
	s.filterFlags.register(cmd, verb)
}

// resolve returns the Selection of the flags, or a usage error when they are not exactly one
// of --id, a filter and --all.
func (s *selection) resolve(cmd *cobra.Command, verb string) (deadletter.Selection, error) {
	n := 0
	for _, given := range []bool{len(s.ids) > 0, s.filterFlags.set(cmd), s.all} {
		if given {
			n++
		}
	}
	if n != 1 {
		return deadletter.Selection{}, usageError(errors.New("choose the dead letters to " + verb + ": --id ID (repeatable), a filter (--reason TEXT, --handler NAME, --from-topic TOPIC, --since, --until) or --all"))
	}
	filter, err := s.filter(cmd, time.Now())
	if err != nil {
		return deadletter.Selection{}, err
	}
	return deadletter.Selection{IDs: s.ids, All: len(s.ids) == 0, Filter: filter}, nil
}

// missed returns the error of a selection that did not find what it named: ids that matched
// no dead letter, or a filter that matched none. Nil for --all.
func missed(sel deadletter.Selection, rep deadletter.Report, q *deadletter.Queue) error {
	if len(rep.NotFound) > 0 {
		return fmt.Errorf("no dead letter with id %s in %s for consumer group %s", strings.Join(quoteAll(rep.NotFound), ", "), q.Topic(), q.Group())
	}
	if !sel.Filter.IsZero() && len(rep.Done)+len(rep.Failed) == 0 {
		if f := sel.Filter; f == (deadletter.Filter{Reason: f.Reason}) {
			return fmt.Errorf("no dead letter whose reason contains %s in %s for consumer group %s", quoted(f.Reason), q.Topic(), q.Group())
		}
		return fmt.Errorf("no dead letter matches the filter in %s for consumer group %s", q.Topic(), q.Group())
	}
	return nil
}

// failed is a chosen dead letter that replay or delete could not handle, and why.
type failed struct {
	ID      string `json:"id"`
	Topic   string `json:"topic"`
	Handler string `json:"handler"`
	Reason  string `json:"reason"`
	Error   string `json:"error"`
}

// kept is a dead letter left in place because it was not chosen.
type kept struct {
	ID      string `json:"id"`
	Topic   string `json:"topic"`
	Handler string `json:"handler"`
	Reason  string `json:"reason"`
}

// failedCount is the part of a summary line that counts failures: nothing when there is none.
func failedCount(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("failed %d, ", n)
}

func failures(results []deadletter.Result) []failed {
	out := []failed{}
	for _, r := range results {
		out = append(out, failed{ID: r.Letter.ID, Topic: r.Letter.Topic, Handler: r.Letter.Handler, Reason: r.Letter.Reason, Error: r.Err.Error()})
	}
	return out
}

func keptOf(letters []deadletter.Letter) []kept {
	out := []kept{}
	for _, l := range letters {
		out = append(out, kept{ID: l.ID, Topic: l.Topic, Handler: l.Handler, Reason: l.Reason})
	}
	return out
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
