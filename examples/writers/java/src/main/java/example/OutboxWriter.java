package example;

import java.net.URI;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;

/**
 * The Java (plain JDBC) writer example: each transaction inserts a business row into
 * example_orders and enqueues its event with outbox_enqueue(...), so that the event is published
 * if and only if the business change commits. Arguments and output: examples/writers/CONTRACT.md.
 */
public final class OutboxWriter {
    static final String LANG = "java-jdbc";

    static final String USAGE = "usage: java -jar outbox-writer.jar --dsn DSN --topic TOPIC --key KEY"
            + " --count N --writer NAME [--rollback]";

    record Options(String dsn, String topic, String key, int count, String writer, boolean rollback) {}

    /** A JDBC URL and the connection properties (user, password) taken out of a libpq URL. */
    record JdbcTarget(String url, Properties props) {}

    public static void main(String[] args) {
        Options o;
        try {
            o = parse(args);
        } catch (IllegalArgumentException e) {
            System.err.println("outbox-writer: " + e.getMessage());
            System.err.println(USAGE);
            System.exit(2);
            return;
        }
        try {
            run(o);
        } catch (SQLException | IllegalArgumentException e) {
            System.err.println("outbox-writer: " + e.getMessage());
            System.exit(1);
        }
    }

    static void run(Options o) throws SQLException {
        JdbcTarget target = toJdbc(o.dsn());
        try (Connection conn = DriverManager.getConnection(target.url(), target.props());
             PreparedStatement order = conn.prepareStatement(
                     "INSERT INTO example_orders (order_key, seq, writer) VALUES (?, ?, ?)");
             // The headers go as text and PostgreSQL parses them: JDBC has no jsonb setter.
             PreparedStatement enqueue = conn.prepareStatement(
                     "SELECT outbox_enqueue(?, ?, ?, ?::jsonb)")) {
            conn.setAutoCommit(false); // every statement below joins the open transaction
            for (int i = 0; i < o.count(); i++) {
                UUID eventId;
                try {
                    order.setString(1, o.key());
                    order.setInt(2, i);
                    order.setString(3, o.writer());
                    order.executeUpdate();

                    enqueue.setString(1, o.topic());
                    enqueue.setString(2, o.key());
                    enqueue.setBytes(3, payload(o, i).getBytes(StandardCharsets.UTF_8)); // bytea
                    enqueue.setString(4, headers(o, i));
                    try (ResultSet rs = enqueue.executeQuery()) {
                        rs.next(); // a scalar function returns exactly one row
                        eventId = rs.getObject(1, UUID.class);
                    }

                    if (o.rollback()) {
                        conn.rollback();
                    } else {
                        conn.commit();
                    }
                } catch (SQLException e) {
                    // Leave nothing half-done behind; keep the first error as the one reported.
                    try {
                        conn.rollback();
                    } catch (SQLException r) {
                        e.addSuppressed(r);
                    }
                    throw new SQLException("seq " + i + ": " + e.getMessage(), e.getSQLState(), e);
                }
                // Printed only once the transaction has ended the way it was asked to.
                System.out.println(o.rollback()
                        ? "{\"event_id\": \"" + eventId + "\", \"seq\": " + i + ", \"rolled_back\": true}"
                        : "{\"event_id\": \"" + eventId + "\", \"seq\": " + i + "}");
            }
        }
    }

    /** The event body: {"writer": NAME, "lang": LANG, "key": KEY, "seq": i}. */
    static String payload(Options o, int seq) {
        return "{\"writer\": " + jsonString(o.writer()) + ", \"lang\": " + jsonString(LANG)
                + ", \"key\": " + jsonString(o.key()) + ", \"seq\": " + seq + "}";
    }

    /** Kafka headers; every value is a string, as the outbox table's CHECK requires. */
    static String headers(Options o, int seq) {
        return "{\"writer\": " + jsonString(o.writer()) + ", \"lang\": " + jsonString(LANG)
                + ", \"seq\": " + jsonString(Integer.toString(seq)) + "}";
    }

    /** A JSON string literal (RFC 8259): quotes, backslashes and control characters escaped. */
    static String jsonString(String s) {
        StringBuilder b = new StringBuilder(s.length() + 2).append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"' -> b.append("\\\"");
                case '\\' -> b.append("\\\\");
                case '\n' -> b.append("\\n");
                case '\r' -> b.append("\\r");
                case '\t' -> b.append("\\t");
                default -> {
                    if (c < 0x20) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
                }
            }
        }
        return b.append('"').toString();
    }

    /**
     * libpq URL to JDBC: postgresql://user:pass@host:port/db?sslmode=require becomes
     * jdbc:postgresql://host:port/db?sslmode=require with user and password as properties (so the
     * password never appears in the URL, for instance in a logged error). pgjdbc takes the same
     * host list syntax (h1:5432,h2:5432) and shares parameter names such as sslmode with libpq.
     */
    static JdbcTarget toJdbc(String dsn) {
        URI uri = URI.create(dsn);
        if (!"postgresql".equals(uri.getScheme()) && !"postgres".equals(uri.getScheme())) {
            throw new IllegalArgumentException("--dsn must be a postgresql:// URL, got scheme " + uri.getScheme());
        }
        // Raw authority rather than getHost(): URI cannot parse a host list, pgjdbc can.
        String authority = uri.getRawAuthority() == null ? "" : uri.getRawAuthority();
        Properties props = new Properties();
        int at = authority.lastIndexOf('@');
        if (at >= 0) {
            String userInfo = authority.substring(0, at);
            int colon = userInfo.indexOf(':');
            props.setProperty("user", decode(colon < 0 ? userInfo : userInfo.substring(0, colon)));
            if (colon >= 0) {
                props.setProperty("password", decode(userInfo.substring(colon + 1)));
            }
        }
        String hosts = authority.substring(at + 1);
        // No database named: pgjdbc, like libpq, then uses the user name, but needs the "/".
        String path = uri.getRawPath() == null || uri.getRawPath().isEmpty() ? "/" : uri.getRawPath();
        String query = uri.getRawQuery() == null ? "" : "?" + uri.getRawQuery();
        return new JdbcTarget(
                "jdbc:postgresql://" + (hosts.isEmpty() ? "localhost" : hosts) + path + query, props);
    }

    /** Percent-decoding as in libpq; "+" stays a plus sign (URLDecoder would make it a space). */
    static String decode(String s) {
        return URLDecoder.decode(s.replace("+", "%2B"), StandardCharsets.UTF_8);
    }

    static Options parse(String[] args) {
        Map<String, String> values = new HashMap<>();
        boolean rollback = false;
        for (int i = 0; i < args.length; i++) {
            String flag = args[i];
            if (flag.equals("--rollback")) {
                rollback = true;
            } else if (!List.of("--dsn", "--topic", "--key", "--count", "--writer").contains(flag)) {
                throw new IllegalArgumentException("unknown argument " + flag);
            } else if (i + 1 == args.length) {
                throw new IllegalArgumentException(flag + " needs a value");
            } else {
                values.put(flag, args[++i]);
            }
        }
        if (values.size() != 5) {
            throw new IllegalArgumentException("--dsn, --topic, --key, --count and --writer are required");
        }
        int count;
        try {
            count = Integer.parseInt(values.get("--count"));
        } catch (NumberFormatException e) {
            count = -1;
        }
        if (count < 0) {
            throw new IllegalArgumentException("--count must be an integer >= 0, got " + values.get("--count"));
        }
        return new Options(values.get("--dsn"), values.get("--topic"), values.get("--key"), count,
                values.get("--writer"), rollback);
    }
}
