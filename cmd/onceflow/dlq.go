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
	"text/tabwriter"
	"time"
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

// listReport is the JSON document of dlq list.
type listReport struct {
	Broker      string       `json:"broker"`
	Topic       string       `json:"topic"`
	Group       string       `json:"group"`
	Count       int          `json:"count"`
	More        bool         `json:"more"`
	DeadLetters []deadLetter `json:"dead_letters"`
}

func newDLQListCommand() *cobra.Command {
	var f dlqFlags
	var withPayload bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "Show the dead letters waiting in the dead-letter topic, without taking them",
		Long: `Prints, oldest first, the dead letters waiting in the dead-letter topic for the consumer group:
id, when it was dead-lettered, the topic it came from, the handler, the attempt, the payload size
and the reason. Nothing is consumed: listing again shows the same dead letters.

How each broker is read without consuming: RabbitMQ by basic.get on the group's queue, then
closing the channel so that every message goes back in its place (with the redelivered flag);
SQL and SQLite queues by reading the messages table past the group's offset; NATS by reading the
stream past the ack floor of the group's consumer; Redis by XPENDING and XRANGE. mem:// cannot
be listed.`,
		Example: `  onceflow dlq list --broker 'amqp://guest:guest@127.0.0.1:5672/?group=billing'
  onceflow dlq list --broker sqlite://var/queue.db --payload --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer b.Close()
			msgs, err := b.Peek(cmd.Context(), f.topic, f.limit+1)
			if err != nil {
				return err
			}
			rep := listReport{Broker: b.String(), Topic: f.topic, Group: b.ConsumerGroup(), DeadLetters: []deadLetter{}}
			if len(msgs) > f.limit {
				msgs, rep.More = msgs[:f.limit], true
			}
			for _, m := range msgs {
				rep.DeadLetters = append(rep.DeadLetters, describe(m, withPayload))
			}
			rep.Count = len(rep.DeadLetters)
			if f.asJSON {
				return writeJSON(cmd.OutOrStdout(), rep)
			}
			printList(cmd.OutOrStdout(), rep, withPayload)
			return nil
		},
	}
	f.register(cmd, defaultListLimit, "show at most this many dead letters")
	cmd.Flags().BoolVar(&withPayload, "payload", false, "show the payloads (as text, or base64 in --json when not UTF-8)")
	return cmd
}

// printList writes the readable form of a list report.
func printList(w io.Writer, rep listReport, withPayload bool) {
	where := fmt.Sprintf("in %s for consumer group %s on %s", rep.Topic, rep.Group, rep.Broker)
	if rep.Count == 0 {
		fmt.Fprintf(w, "no dead letters %s\n", where)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	header := "ID\tDEAD-LETTERED\tTOPIC\tHANDLER\tATTEMPT\tSIZE\tREASON"
	if withPayload {
		header += "\tPAYLOAD"
	}
	fmt.Fprintln(tw, header)
	for _, d := range rep.DeadLetters {
		line := fmt.Sprintf("%s\t%s\t%s\t%s\t%d\t%d\t%s", cell(d.ID, 0), cell(d.Time, 0), cell(d.Topic, 0), cell(d.Handler, 0),
			d.Attempt, d.PayloadSize, cell(d.Reason, tableReasonWidth))
		if withPayload {
			p := ""
			if d.Payload != nil {
				p = *d.Payload
			} else {
				p = "base64:" + d.PayloadBase64
			}
			line += "\t" + strconv.Quote(truncate(p, tablePayloadWidth))
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	more := ""
	if rep.More {
		more = " (more are waiting: raise --limit)"
	}
	fmt.Fprintf(w, "%d dead letters %s%s\n", rep.Count, where, more)
}

// cell makes s fit a table cell: one line, at most width runes (no bound for 0), "-" if empty.
func cell(s string, width int) string {
	if s == "" {
		return "-"
	}
	s = strings.Join(strings.Fields(s), " ")
	if width > 0 {
		s = truncate(s, width)
	}
	return s
}

// truncate cuts s to at most n runes, marking the cut.
func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// replayed and kept are the entries of a replay report.
type replayed struct {
	ID      string `json:"id"`
	To      string `json:"to"`
	Handler string `json:"handler"`
	Attempt int    `json:"attempt"`
	Reason  string `json:"reason"`
	Replays int    `json:"replays"`
}

type kept struct {
	ID      string `json:"id"`
	Topic   string `json:"topic"`
	Handler string `json:"handler"`
	Reason  string `json:"reason"`
}

// replayReport is the JSON document of dlq replay.
type replayReport struct {
	Broker   string     `json:"broker"`
	Topic    string     `json:"topic"`
	Group    string     `json:"group"`
	Replayed []replayed `json:"replayed"`
	Kept     []kept     `json:"kept"`
	// NotFound lists the --id values that matched no dead letter.
	NotFound []string `json:"not_found"`
	// NoTopic lists the selected dead letters left in place because they name no original
	// topic and --to was not given.
	NoTopic []string `json:"no_topic"`
	// Limited is true when the replay looked at --limit dead letters: more may be waiting.
	Limited bool `json:"limited"`
}

func newDLQReplayCommand() *cobra.Command {
	var f dlqFlags
	var ids []string
	var all bool
	var to string
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Put dead letters back on the topic they came from",
		Long: `Publishes the chosen dead letters (--id, repeatable, or --all) to the topic they were consumed
from (their onceflow_dlq_topic header, or --to), and only once the broker has stored that
publish removes them from the dead-letter topic. The others stay where they are, in their order.

A replayed message keeps its original id, payload and headers, so it goes through the handler's
duplicate detection again: a message that was in fact applied is acknowledged without being
applied again, and replaying the same message twice applies it at most once. The dead-letter
headers (onceflow_dlq_*) are removed; onceflow_replay_count counts the replays and
onceflow_replay_time says when the last one was. A crash between the publish and the removal
leaves the dead letter in place as well: it is replayed again next time, and deduplication
absorbs the duplicate. Nothing is lost.

What removal means: RabbitMQ acknowledges the message on the group's queue (other groups'
queues keep their copies); the SQL and SQLite queues delete its row, NATS deletes it from the
stream, Redis acknowledges it for the group and deletes the entry: other consumer groups of the
dead-letter topic no longer see it either. On NATS the replay is published with a Nats-Msg-Id of
its own, so that JetStream does not drop it as a duplicate of the original publish.

The exit status is 1 when an --id matched no dead letter or a chosen dead letter names no topic.`,
		Example: `  onceflow dlq replay --broker sqlite://var/queue.db --id order-17 --id order-18
  onceflow dlq replay --broker 'nats://127.0.0.1:4222?group=billing' --all
  onceflow dlq replay --broker "$ONCEFLOW_BROKER" --all --to orders.retry --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if all == (len(ids) > 0) {
				return errors.New("choose the dead letters to replay: --id ID (repeatable) or --all")
			}
			wanted := map[string]bool{}
			for _, id := range ids {
				wanted[id] = true
			}
			b, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer b.Close()

			now := time.Now().UTC().Format(time.RFC3339Nano)
			rep := replayReport{Broker: b.String(), Topic: f.topic, Group: b.ConsumerGroup(),
				Replayed: []replayed{}, Kept: []kept{}, NotFound: []string{}, NoTopic: []string{}}
			found := map[string]bool{}
			res, moveErr := b.Move(cmd.Context(), f.topic, f.limit, func(m *message.Message) (string, *message.Message) {
				if !all && !wanted[m.UUID] {
					return "", nil
				}
				found[m.UUID] = true
				dest := to
				if dest == "" {
					dest = m.Metadata.Get(messagedata.HeaderDeadLetterTopic)
				}
				if dest == "" {
					rep.NoTopic = append(rep.NoTopic, m.UUID)
					return "", nil
				}
				return dest, replayMessage(m, now)
			})
			for _, mv := range res.Moved {
				d := describe(mv.Message, false)
				rep.Replayed = append(rep.Replayed, replayed{ID: d.ID, To: mv.To, Handler: d.Handler, Attempt: d.Attempt,
					Reason: d.Reason, Replays: d.Replays + 1})
			}
			for _, m := range res.Kept {
				d := describe(m, false)
				rep.Kept = append(rep.Kept, kept{ID: d.ID, Topic: d.Topic, Handler: d.Handler, Reason: d.Reason})
			}
			for id := range wanted {
				if !found[id] {
					rep.NotFound = append(rep.NotFound, id)
				}
			}
			sort.Strings(rep.NotFound)
			rep.Limited = len(res.Moved)+len(res.Kept) >= f.limit

			if f.asJSON {
				if err := writeJSON(cmd.OutOrStdout(), rep); err != nil {
					return errors.Join(moveErr, err)
				}
			} else {
				printReplay(cmd.OutOrStdout(), rep)
			}
			var errs []error
			if moveErr != nil {
				errs = append(errs, moveErr)
			}
			if len(rep.NotFound) > 0 {
				errs = append(errs, fmt.Errorf("no dead letter with id %s in %s for consumer group %s", strings.Join(quoteAll(rep.NotFound), ", "), f.topic, b.ConsumerGroup()))
			}
			if len(rep.NoTopic) > 0 {
				errs = append(errs, fmt.Errorf("dead letters %s name no original topic (header %s): pass --to", strings.Join(quoteAll(rep.NoTopic), ", "), messagedata.HeaderDeadLetterTopic))
			}
			return errors.Join(errs...)
		},
	}
	f.register(cmd, defaultReplayLimit, "look at most at this many dead letters, oldest first")
	fl := cmd.Flags()
	fl.StringArrayVar(&ids, "id", nil, "id of a dead letter to replay (repeatable)")
	fl.BoolVar(&all, "all", false, "replay every dead letter waiting (up to --limit)")
	fl.StringVar(&to, "to", "", "publish to this topic instead of the one each dead letter came from")
	return cmd
}

// replayMessage returns the message that replays dead letter m: its id (the original one, when
// the dead-letter broker could not carry it and the dead letter kept it in a header), payload
// and headers, without the dead-letter headers, with the replay count and time.
func replayMessage(m *message.Message, now string) *message.Message {
	id := m.UUID
	if orig := m.Metadata.Get(messagedata.HeaderDeadLetterOriginalID); orig != "" {
		id = orig
	}
	out := message.NewMessage(id, m.Payload)
	for k, v := range m.Metadata {
		out.Metadata[k] = v
	}
	for _, h := range deadLetterHeaders {
		delete(out.Metadata, h)
	}
	// Properties of the delivery the dead letter was read from, not of the message.
	delete(out.Metadata, broker.HeaderAMQPRedelivered)
	n, _ := strconv.Atoi(m.Metadata.Get(messagedata.HeaderReplayCount))
	out.Metadata[messagedata.HeaderReplayCount] = strconv.Itoa(n + 1)
	out.Metadata[messagedata.HeaderReplayTime] = now
	return out
}

// printReplay writes the readable form of a replay report.
func printReplay(w io.Writer, rep replayReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, r := range rep.Replayed {
		fmt.Fprintf(tw, "replayed\t%s\t-> %s\thandler %s, attempt %d: %s\n", cell(r.ID, 0), cell(r.To, 0), cell(r.Handler, 0), r.Attempt, cell(r.Reason, tableReasonWidth))
	}
	for _, k := range rep.Kept {
		fmt.Fprintf(tw, "kept\t%s\t   %s\thandler %s: %s\n", cell(k.ID, 0), cell(k.Topic, 0), cell(k.Handler, 0), cell(k.Reason, tableReasonWidth))
	}
	tw.Flush()
	more := ""
	if rep.Limited {
		more = " (the first --limit; more may be waiting)"
	}
	fmt.Fprintf(w, "replayed %d, kept %d dead letters in %s for consumer group %s on %s%s\n",
		len(rep.Replayed), len(rep.Kept), rep.Topic, rep.Group, rep.Broker, more)
	for _, id := range rep.NotFound {
		fmt.Fprintf(w, "not found: %s\n", id)
	}
	for _, id := range rep.NoTopic {
		fmt.Fprintf(w, "no original topic: %s (pass --to)\n", id)
	}
}

func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = strconv.Quote(s)
	}
	return out
}
