package main

import (
	"fmt"
	"io"
	"sort"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/deadletter"
)

// listReport is the JSON document of dlq list.
type listReport struct {
	Broker string `json:"broker"`
	Topic  string `json:"topic"`
	Group  string `json:"group"`
	Count  int    `json:"count"`
	More   bool   `json:"more"`
	// Groups are the dead letters listed, grouped by handler and reason.
	Groups      []letterGroup `json:"groups"`
	DeadLetters []deadLetter  `json:"dead_letters"`
}

// letterGroup is the dead letters of one handler with one reason.
type letterGroup struct {
	Handler string   `json:"handler"`
	Reason  string   `json:"reason"`
	Count   int      `json:"count"`
	IDs     []string `json:"ids"`
}

// groupLetters groups dls by handler and exact reason: the largest group first, groups of the
// same size in the order of their oldest dead letter.
func groupLetters(dls []deadLetter) []letterGroup {
	type key struct{ handler, reason string }
	at := map[key]int{}
	out := []letterGroup{}
	for _, d := range dls {
		k := key{d.Handler, d.Reason}
		i, ok := at[k]
		if !ok {
			i = len(out)
			at[k] = i
			out = append(out, letterGroup{Handler: d.Handler, Reason: d.Reason, IDs: []string{}})
		}
		out[i].Count++
		out[i].IDs = append(out[i].IDs, d.ID)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Count > out[j].Count })
	return out
}

func newDLQListCommand() *cobra.Command {
	var f dlqFlags
	var filter filterFlags
	var withPayload bool
	var offset int
	cmd := &cobra.Command{
		Use:   "list",
		Short: "Show the dead letters waiting in the dead-letter topic, without taking them",
		Long: `Prints the dead letters waiting in the dead-letter topic for the consumer group: first a summary,
how many dead letters each handler dead-lettered with each reason (the largest group first),
then the dead letters themselves, oldest first: id, when it was dead-lettered, the topic it came
from, the handler, the delivery count and the processing attempt of that delivery at which it
was given up (as the handler's log line said them; "-" when nobody counted), the payload size
("dropped" when the dead-letter broker refused the payload) and the reason. Nothing is
consumed: listing again shows the same dead letters. The counts are of the dead letters listed
(at most --limit, from the --offset-th on). The filters (--reason, --handler, --from-topic, --since, --until) show only the dead letters that
match them all, among the first 10000 waiting.

Text that comes from the messages (ids, reasons, handlers, payloads) is printed with Go escapes
for what a terminal would interpret: \x1b for ESC, \n, \t, \xff for a byte that is not UTF-8,
\\ for a backslash. --json prints the values themselves.

How each broker is read without consuming: RabbitMQ by basic.get on the group's queue, then
closing the channel so that every message goes back in its place (with the redelivered flag);
SQL and SQLite queues by reading, without a lock, the messages the group has leased and those
past its cursor; NATS by reading the stream past the ack floor of the group's consumer; Redis by
XPENDING and XRANGE; Kafka from each partition's committed offset of the group. mem:// cannot
be listed.`,
		Example: `  onceflow dlq list --broker 'amqp://guest:guest@127.0.0.1:5672/?group=billing'
  onceflow dlq list --broker sqlite://var/queue.db --payload --json
  onceflow dlq list --broker "$ONCEFLOW_BROKER" --handler ledger --since 2h --limit 20 --offset 20`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if offset < 0 {
				return usagef("--offset %d: want 0 or more", offset)
			}
			flt, err := filter.filter(cmd, time.Now())
			if err != nil {
				return err
			}
			q, closeBroker, err := f.open(cmd.Context(), 0)
			if err != nil {
				return err
			}
			defer closeBroker()
			page, err := q.List(cmd.Context(), deadletter.Query{Filter: flt, Offset: offset, Limit: f.limit})
			if err != nil {
				return notFound(err, q)
			}
			rep := listReport{Broker: q.Broker(), Topic: q.Topic(), Group: q.Group(), More: page.More, DeadLetters: []deadLetter{}}
			for _, l := range page.Letters {
				rep.DeadLetters = append(rep.DeadLetters, describe(l, withPayload))
			}
			rep.Count = len(rep.DeadLetters)
			rep.Groups = groupLetters(rep.DeadLetters)
			if f.asJSON {
				return writeJSON(cmd.OutOrStdout(), rep)
			}
			printList(cmd.OutOrStdout(), rep, withPayload)
			return nil
		},
	}
	f.register(cmd, defaultListLimit, "show at most this many dead letters")
	filter.register(cmd, "show")
	cmd.Flags().IntVar(&offset, "offset", 0, "skip this many matching dead letters first (the next page starts at --offset plus --limit)")
	cmd.Flags().BoolVar(&withPayload, "payload", false, "show the payloads (as text, or base64 in --json when not UTF-8)")
	return cmd
}

// printList writes the readable form of a list report.
func printList(w io.Writer, rep listReport, withPayload bool) {
	loc := where(rep.Topic, rep.Group, rep.Broker)
	if rep.Count == 0 {
		fmt.Fprintf(w, "no dead letters %s\n", loc)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "COUNT\tHANDLER\tREASON")
	for _, g := range rep.Groups {
		fmt.Fprintf(tw, "%d\t%s\t%s\n", g.Count, cell(g.Handler, 0), cell(g.Reason, tableReasonWidth))
	}
	tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	header := "ID\tDEAD-LETTERED\tTOPIC\tHANDLER\tDELIVERY\tATTEMPT\tSIZE\tREASON"
	if withPayload {
		header += "\tPAYLOAD"
	}
	fmt.Fprintln(tw, header)
	for _, d := range rep.DeadLetters {
		size := strconv.Itoa(d.PayloadSize)
		if d.PayloadDropped != "" {
			size = "dropped"
		}
		line := fmt.Sprintf("%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s", cell(d.ID, 0), cell(d.Time, 0), cell(d.Topic, 0), cell(d.Handler, 0),
			count(d.Deliveries), d.Attempt, size, cell(d.Reason, tableReasonWidth))
		if withPayload {
			p := ""
			if d.Payload != nil {
				p = *d.Payload
			} else {
				p = "base64:" + d.PayloadBase64
			}
			line += "\t" + quoted(truncate(p, tablePayloadWidth))
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	more := ""
	if rep.More {
		more = " (more are waiting: raise --limit)"
	}
	fmt.Fprintf(w, "%s %s%s\n", plural(rep.Count, "dead letter"), loc, more)
}
